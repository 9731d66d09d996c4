"""A real Gym agent's reply stored apart from the token arrays its records hold (`payloads.replies`):
made whole again, it is the agent's reply byte for byte; where its arrays are not its records', it
is stored whole."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from payloads import PayloadClaim, PayloadPlane, open_payload_store
from payloads.replies import (
    REPLY_APART_MEDIA_TYPE,
    REPLY_MEDIA_TYPE,
    put_arrays_back,
    reply_to_store,
    take_arrays_off,
)
from projections.payload_audit import PAYLOAD_INTACT, PayloadAuditSummary, PayloadFacts, check_payloads
from protocol.digests import canonical_bytes, sha256_digest
from protocol.token_codec import (
    TOKENS_MEDIA_TYPE,
    TOKENS_REPLY_MEDIA_TYPE,
    TokenCodecError,
    encode_entries,
    encode_records,
    refer_to_reply,
    reply_output_of,
)
from protocol.tokens import TOKEN_FIELDS, token_records_from_reply
from tests.gym.test_token_records import ANSWER, TOOL_CALL, TOOL_OUTPUT, _carrier, _reply
from tests.payloads.test_reply_items import _stored


def _beside(reply: dict[str, Any], records: list[dict[str, Any]]) -> bytes:
    """The records stored beside `reply` as the trainer stores them (form version 2)."""
    v2, media_type = refer_to_reply(encode_records(records), reply_output_of(reply))
    assert media_type == TOKENS_REPLY_MEDIA_TYPE
    return v2


def two_calls(generated: tuple[int, ...] = (4, 5), **first: Any) -> tuple[dict[str, Any], bytes]:
    """A plain Gym agent's reply (each call's arrays on its message, a tool output between the two
    calls) and its records beside it, read off the reply as the participant reads them."""
    reply = _reply(
        [
            _carrier("function_call", [1, 2, 3], list(generated), **{**TOOL_CALL, **first}),
            TOOL_OUTPUT,
            _carrier("message", [1, 2, 3, 4, 5, 9, 9], [6], **ANSWER),
        ]
    )
    records = [
        r.model_dump(mode="json", exclude_unset=True) for r in token_records_from_reply(reply, "k", 7.0)
    ]
    payload = _stored(reply.payload())
    return payload, _beside(payload, records)


def put_apart(plane: PayloadPlane) -> tuple[PayloadClaim, PayloadClaim, str]:
    """`two_calls`' reply put in `plane` as the trainer stores it, apart from its records' arrays, and
    the records beside it: the reply's claim, the records' claim, and the whole reply's digest."""
    reply, tokens = two_calls()
    apart = take_arrays_off(reply, tokens)
    assert apart is not None
    apart_claim, tokens_claim = plane.put(
        [(canonical_bytes(apart), REPLY_APART_MEDIA_TYPE), (tokens, TOKENS_REPLY_MEDIA_TYPE)]
    )
    return apart_claim, tokens_claim, sha256_digest(canonical_bytes(reply))


def test_a_reply_stored_apart_is_made_whole_byte_for_byte() -> None:
    reply, tokens = two_calls()
    whole = canonical_bytes(reply)
    stored, media_type = reply_to_store(reply, whole, tokens, TOKENS_REPLY_MEDIA_TYPE)
    assert media_type == REPLY_APART_MEDIA_TYPE
    assert len(stored) < len(whole)
    apart = orjson.loads(stored)
    # No array is stored twice: every item the records name lost exactly its arrays, nothing else.
    for before, after in zip(reply_output_of(reply), reply_output_of(apart), strict=True):
        assert not set(after) & set(TOKEN_FIELDS)
        assert {k: v for k, v in before.items() if k not in TOKEN_FIELDS} == after
    assert (
        apart["reward"] == reply["reward"]
        and apart["responses_create_params"] == reply["responses_create_params"]
    )
    made = put_arrays_back(apart, tokens)
    assert canonical_bytes(made) == whole  # the digest the agent's receipt names
    assert sha256_digest(canonical_bytes(made)) == sha256_digest(whole)


def test_a_reply_whose_arrays_are_not_its_records_is_stored_whole() -> None:
    reply, tokens = two_calls()
    whole = canonical_bytes(reply)
    item = reply_output_of(reply)[2]
    for name, value in (
        (
            "generation_log_probs",
            [0],
        ),  # the integer 0 where the record holds the float 0.0... or another value
        ("generation_token_ids", [True]),  # a boolean where the record holds an id
        ("prompt_token_ids", [1, 2, 3, 4, 5, 9]),  # one id short
    ):
        changed = {**reply, "response": {**reply["response"], "output": list(reply_output_of(reply))}}
        changed["response"]["output"][2] = {**item, name: value}
        assert take_arrays_off(changed, tokens) is None, name
        assert reply_to_store(changed, whole, tokens, TOKENS_REPLY_MEDIA_TYPE) == (whole, REPLY_MEDIA_TYPE)
    # An item without one of the arrays its record holds (taken off by whom?): whole too.
    changed["response"]["output"][2] = {k: v for k, v in item.items() if k != "generation_log_probs"}
    assert take_arrays_off(changed, tokens) is None
    # Records stored in version 1 (none refers to the reply): nothing to make whole from.
    v1 = encode_records(
        [{"prompt_token_ids": [1], "generation_token_ids": [2], "generation_log_probs": [-0.5]}]
    )
    assert reply_to_store(reply, whole, v1, TOKENS_MEDIA_TYPE) == (whole, REPLY_MEDIA_TYPE)
    assert reply_to_store(reply, whole, None, None) == (whole, REPLY_MEDIA_TYPE)


def test_a_reply_of_the_binary_path_carries_no_arrays_and_is_stored_whole() -> None:
    """The reference agent's replies carry no arrays (its records travel apart): nothing taken off."""
    reply, tokens = two_calls()
    bare = {
        **reply,
        "response": {
            **reply["response"],
            "output": [{k: v for k, v in i.items() if k not in TOKEN_FIELDS} for i in reply_output_of(reply)],
        },
    }
    assert take_arrays_off(bare, tokens) is None


def test_routed_experts_go_apart_with_the_arrays_and_come_back() -> None:
    routes = "nrlre1:int16:3x1x2:AAAAAAAAAAAAAAAA"
    reply, tokens = two_calls(routed_experts=routes)
    stored, media_type = reply_to_store(reply, canonical_bytes(reply), tokens, TOKENS_REPLY_MEDIA_TYPE)
    assert media_type == REPLY_APART_MEDIA_TYPE and routes.encode() not in stored
    assert canonical_bytes(put_arrays_back(orjson.loads(stored), tokens)) == canonical_bytes(reply)


def test_made_whole_with_another_replys_records_is_refused_or_not_the_reply() -> None:
    reply, tokens = two_calls()
    apart = take_arrays_off(reply, tokens)
    assert apart is not None
    short = {**apart, "response": {**apart["response"], "output": reply_output_of(apart)[:2]}}
    with pytest.raises(TokenCodecError, match="output item 2 of a reply that has no such item"):
        put_arrays_back(short, tokens)


_logprob = st.one_of(
    st.floats(width=32, allow_nan=False, allow_infinity=False, min_value=-50, max_value=0),
    st.sampled_from([-0.0, 0.0, -1e-7, -1.5e-5, -0.00001234, -1e-9]),
    st.floats(allow_nan=False, allow_infinity=False, min_value=-50, max_value=0),  # not a float32
)
_ids = st.lists(st.integers(0, 2**32 + 5), max_size=6)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.lists(
        st.tuples(_ids, st.lists(st.tuples(st.integers(0, 2**31), _logprob), max_size=6)),
        min_size=1,
        max_size=3,
    ),
    st.lists(st.sampled_from(["int", "bool", "other", "keep"]), min_size=3, max_size=3),
)
def test_stored_apart_only_where_made_whole_is_the_reply(
    calls: list[tuple[list[int], list[tuple[int, float]]]], edits: list[str]
) -> None:
    """Any arrays (float32 or not, -0.0, orjson's small-float forms, ids past 32 bits), the reply's
    items edited after the records were read (an integer for a float, a boolean for an id, another
    value): whenever the reply is stored apart, made whole it is the reply, byte for byte; and a reply
    whose items are its records' is always stored apart."""
    items = []
    for k, (prompt, generated) in enumerate(calls):
        ids, lps = [g for g, _ in generated], [lp for _, lp in generated]
        items.append(
            {
                "type": "message",
                "id": f"m{k}",
                "content": [{"type": "output_text", "text": f"t{k}"}],
                "prompt_token_ids": prompt,
                "generation_token_ids": ids,
                "generation_log_probs": lps,
            }
        )
    reply_model = _reply(items)
    records = [
        r.model_dump(mode="json", exclude_unset=True) for r in token_records_from_reply(reply_model, "k", 1.0)
    ]
    reply = _stored(reply_model.payload())
    tokens = _beside(reply, records)
    whole = canonical_bytes(reply)
    stored, media_type = reply_to_store(reply, whole, tokens, TOKENS_REPLY_MEDIA_TYPE)
    assert media_type == REPLY_APART_MEDIA_TYPE
    assert canonical_bytes(put_arrays_back(orjson.loads(stored), tokens)) == whole
    # The same records beside a reply whose first item was edited after they were read.
    output = list(reply_output_of(reply))
    first = dict(output[0])
    edit = edits[0]
    if edit == "int" and first["generation_log_probs"]:
        first["generation_log_probs"] = [
            int(first["generation_log_probs"][0]),
            *first["generation_log_probs"][1:],
        ]
    elif edit == "bool" and first["prompt_token_ids"]:
        first["prompt_token_ids"] = [bool(first["prompt_token_ids"][0] % 2), *first["prompt_token_ids"][1:]]
    elif edit == "other":
        first["generation_token_ids"] = [*first["generation_token_ids"], 7]
    output[0] = first
    edited = {**reply, "response": {**reply["response"], "output": output}}
    edited_whole = canonical_bytes(edited)
    stored, media_type = reply_to_store(edited, edited_whole, tokens, TOKENS_REPLY_MEDIA_TYPE)
    if media_type == REPLY_APART_MEDIA_TYPE:
        assert canonical_bytes(put_arrays_back(orjson.loads(stored), tokens)) == edited_whole
    else:
        assert stored == edited_whole and edited_whole != whole


def audit_apart(
    tmp_path: Path,
    reply: dict[str, Any],
    tokens: bytes,
    other_tokens: bytes,
    media_type: str = TOKENS_REPLY_MEDIA_TYPE,
) -> None:
    """`reply` stored apart from its records `tokens` (of `media_type`): the audit makes it whole,
    the receipt's reply; with another try's records (`other_tokens`), or under another digest,
    payload-intact names it."""
    apart = take_arrays_off(reply, tokens)
    assert apart is not None
    plane = PayloadPlane(open_payload_store(tmp_path.as_uri()))
    apart_claim, tokens_claim, other_claim = plane.put(
        [
            (canonical_bytes(apart), REPLY_APART_MEDIA_TYPE),
            (tokens, media_type),
            (other_tokens, media_type),
        ]
    )
    digest = sha256_digest(canonical_bytes(reply))
    found: list[tuple[str, list[int], str]] = []
    for records, receipt_digest, violations in (
        (tokens_claim, digest, 0),
        (other_claim, digest, 1),
        (tokens_claim, sha256_digest(b"{}"), 1),
    ):
        facts = PayloadFacts()
        facts.see(5, [apart_claim, records])
        facts.apart.append((apart_claim, records, receipt_digest, 5))
        found.clear()
        check_payloads(facts, plane, lambda *v: found.append(v), PayloadAuditSummary())
        assert len(found) == violations, found
        if violations:
            assert (
                found[0][:2] == (PAYLOAD_INTACT, [5]) and "is not the reply its receipt names" in found[0][2]
            )


def test_the_audit_makes_each_reply_stored_apart_whole(tmp_path: Path) -> None:
    """Both payloads intact, the reply stored apart and its records: made whole, the receipt's reply;
    with another try's records, or under another digest, payload-intact names it."""
    reply, tokens = two_calls()
    _, other_tokens = two_calls(generated=(4, 8))  # the same items, another generation
    audit_apart(tmp_path, reply, tokens, other_tokens)


def test_a_reply_stored_apart_at_real_size_is_a_fraction_of_it() -> None:
    """A 9k-token plain Gym reply: its arrays were most of its bytes."""
    import random

    from benchmarks.gym_reply import plain_gym_reply
    from benchmarks.token_path import agent_episodes

    [(run_reply, records)] = agent_episodes(1, 1000, 8000, (1, 1))
    payload = _stored(plain_gym_reply(run_reply, records, 0.0, random.Random(0)))
    entries = encode_entries(records)
    tokens, media_type = refer_to_reply(entries, reply_output_of(payload))
    whole = canonical_bytes(payload)
    stored, stored_type = reply_to_store(payload, whole, tokens, media_type)
    assert stored_type == REPLY_APART_MEDIA_TYPE
    assert len(stored) < 0.3 * len(whole)
    assert canonical_bytes(put_arrays_back(orjson.loads(stored), tokens)) == whole


def test_run_replied_names_the_records_a_reply_stored_apart_is_made_whole_from() -> None:
    from pydantic import ValidationError

    from eventstore.events import RunReplied
    from eventstore.upcasting import upcast
    from payloads import PayloadClaim

    reply, tokens = two_calls()
    whole = canonical_bytes(reply)
    apart = canonical_bytes(take_arrays_off(reply, tokens))
    digest = sha256_digest(whole)

    def claim(content: bytes, media_type: str) -> PayloadClaim:
        return PayloadClaim.of(content, media_type, "local")

    base = {
        "rollout_id": "k_g0",
        "attempt_index": 0,
        "reward": 1.0,
        "mask_sample": False,
        "reply_digest": digest,
    }
    records = claim(tokens, TOKENS_REPLY_MEDIA_TYPE)
    event = RunReplied(**base, reply=claim(apart, REPLY_APART_MEDIA_TYPE), apart_from=records)
    assert event.reply_claim() == claim(apart, REPLY_APART_MEDIA_TYPE) and event.apart_from == records
    for bad, message in (
        ({"reply": claim(apart, REPLY_APART_MEDIA_TYPE)}, "names the token records"),
        ({"reply": claim(whole, REPLY_MEDIA_TYPE), "apart_from": records}, "and only it"),
        ({"reply": claim(apart, REPLY_MEDIA_TYPE)}, "another digest than reply_digest"),
        (
            {"reply": claim(apart, REPLY_APART_MEDIA_TYPE), "apart_from": claim(tokens, TOKENS_MEDIA_TYPE)},
            "only from token records of",
        ),
    ):
        with pytest.raises(ValidationError, match=message):
            RunReplied(**base, **bad)
    # A version 3 row (every reply whole) reads as it was written.
    v3 = {**base, "failure_kind": None, "reply": claim(whole, REPLY_MEDIA_TYPE).model_dump(mode="json")}
    read = RunReplied.model_validate(upcast("RunReplied", 3, RunReplied.schema_version, v3))
    assert read.reply_claim() == claim(whole, REPLY_MEDIA_TYPE) and read.apart_from is None
