"""`RunReply.parsed_payload()`: for a reply read off JSON it is `payload()`, value for value and byte
for byte in canonical JSON, with its JSON-valued fields shared instead of copied."""

from __future__ import annotations

from typing import Any

import orjson
from hypothesis import given, settings
from hypothesis import strategies as st

from protocol.digests import canonical_bytes
from protocol.wire import RunReply, gym_reply
from tests.hostile.test_event_decoding import json_values


@settings(max_examples=300, deadline=None)
@given(
    response=st.dictionaries(st.text(max_size=6), json_values, max_size=5),
    params=st.none() | st.dictionaries(st.text(max_size=6), json_values, max_size=3),
    reward=st.integers(-5, 5) | st.floats(-10, 10),
    extras=st.dictionaries(st.sampled_from(["instance_config", "task", "x"]), json_values, max_size=2),
    mask=st.none() | st.booleans(),
    with_identity=st.booleans(),
)
def test_a_reply_read_off_json_has_its_payload_without_a_copy(
    response: dict[str, Any],
    params: dict[str, Any] | None,
    reward: float,
    extras: dict[str, Any],
    mask: bool | None,
    with_identity: bool,
) -> None:
    body: dict[str, Any] = {"response": response, "reward": reward, **extras}
    if params is not None:
        body["responses_create_params"] = params
    if mask is not None:
        body["mask_sample"] = mask
    if with_identity:
        body.update(_ng_rollout_id="r_g0", _ng_attempt_index=1, id="res-1")
    raw = orjson.dumps(body)
    replies = [gym_reply(orjson.loads(raw), "r_g0", 1)]
    if with_identity:  # a participant's reply names its try itself
        replies.append(RunReply.model_validate_json(raw))
    for reply in replies:
        parsed = reply.parsed_payload()
        assert parsed == reply.payload()
        assert canonical_bytes(parsed) == canonical_bytes(reply.payload())
        assert parsed["response"] is reply.response  # shared: nothing copied
        assert ("responses_create_params" in parsed) == (params is not None)


@settings(max_examples=300, deadline=None)
@given(
    response=st.dictionaries(st.text(max_size=6), json_values, max_size=5),
    reward=st.integers(-5, 5) | st.floats(-10, 10),
    extras=st.dictionaries(st.sampled_from(["instance_config", "task", "x"]), json_values, max_size=2),
    with_identity=st.booleans(),
)
def test_a_reply_is_parsed_from_its_json_exactly_when_it_writes_that_json(
    response: dict[str, Any], reward: float, extras: dict[str, Any], with_identity: bool
) -> None:
    """`parsed_from(payload)`: the reply validated from `payload` writes `payload`'s canonical JSON (the
    trainer then takes a completion frame's reply bytes for the reply's); not where validation filled in
    the try's identity or made an integer reward a float."""
    body: dict[str, Any] = {"response": response, "reward": reward, **extras}
    if with_identity:
        body.update(_ng_rollout_id="r_g0", _ng_attempt_index=1, id="res-1")
    payload = orjson.loads(orjson.dumps(body))
    reply = gym_reply(payload, "r_g0", 1)
    same = canonical_bytes(reply.parsed_payload()) == canonical_bytes(payload)
    assert reply.parsed_from(payload) == same
    if with_identity and isinstance(reward, float):
        assert same  # a participant's reply: what it sent is what the trainer holds
    if type(reward) is int or not with_identity:
        assert not same
    assert not reply.parsed_from([payload]) and not reply.parsed_from({**payload, "more": 1})
